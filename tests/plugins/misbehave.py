"""Candidates that misbehave the ways untrusted code can (issue 12). Each computes a correct
Llama-order RMSNorm except for the one thing its name says; `misbehave` is the sweep's switch:
`fault` happens on the `at`-th call of the process (counting from 1), correct output otherwise."""

import ctypes
import os
import re
import signal
import sys
import time

import torch


def _correct(x, weight, eps):
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _marker():
    if os.environ.get("PARITY_TEST_MARKER"):
        open(os.environ["PARITY_TEST_MARKER"], "w").close()


# --- writes into what it is handed -------------------------------------------------------------

def scribble_weight_then_use(x, weight, eps):
    """A wrong gain (w + 1000) that it writes into the weight it was handed first."""
    weight.add_(1000.0)
    return _correct(x, weight, eps)


def wrong_gain(x, weight, eps):
    """The same wrong gain without the in-place write: the control."""
    return _correct(x, weight + 1000.0, eps)


def scribble_after(x, weight, eps):
    """Correct output, then it wrecks its weight and input: still a pass."""
    y = _correct(x, weight, eps)
    weight.fill_(float("nan"))
    x.fill_(float("nan"))
    return y


def zero_input_then_use(x, weight, eps):
    """Zeroes its input before normalising: all-zero output, a wrong kernel."""
    x.zero_()
    return _correct(x, weight, eps)


# --- process-level faults ------------------------------------------------------------------------

def os_exit_0(x, weight, eps):
    os._exit(0)


def os_exit_1(x, weight, eps):
    os._exit(1)


def sys_exit(x, weight, eps):
    sys.exit(0)


def keyboard_interrupt(x, weight, eps):
    raise KeyboardInterrupt


def segfault(x, weight, eps):
    ctypes.string_at(0)


def gil_hog(x, weight, eps):
    """Catastrophic backtracking in the C regex engine: holds the GIL, ignores signals."""
    re.match(r"(a+)+$", "a" * 64 + "b")
    return _correct(x, weight, eps)


def sleeps_forever(x, weight, eps):
    _marker()
    time.sleep(10**6)


def memory_hoarder(x, weight, eps):
    """Touches 64 MiB blocks until 6 GiB; then (if nothing stopped it) returns a wrong answer."""
    hoard = []
    for _ in range(96):
        hoard.append(bytearray(64 << 20))
    return _correct(x, weight, eps) * 2


def prints(x, weight, eps):
    print("hello from the candidate")
    print("to stderr too", file=sys.stderr)
    return _correct(x, weight, eps)


def forks(x, weight, eps):
    """Both processes return: only the original may speak."""
    os.fork()
    return _correct(x, weight, eps)


def chdir(x, weight, eps):
    os.chdir("/")
    return _correct(x, weight, eps)


def writes_to_every_fd(x, weight, eps):
    """Garbage on whatever pipe it can find, then a correct answer."""
    for fd in range(3, 64):
        try:
            os.write(fd, b"\xff" * 64)
        except OSError:
            pass
    return _correct(x, weight, eps)


def kills_itself(x, weight, eps):
    os.kill(os.getpid(), signal.SIGKILL)


def device_assert_once(x, weight, eps):
    """On the first call of the first process only (a flag file marks it): an out-of-range index
    on the GPU, a device-side assert that poisons that process's CUDA context."""
    flag = os.environ["PARITY_TEST_FLAG"]
    if not os.path.exists(flag):
        open(flag, "w").close()
        idx = torch.tensor([1 << 40], device=x.device)
        x[idx].sum().item()
    return _correct(x, weight, eps)


def cuda_oom(x, weight, eps):
    torch.empty(1 << 50, dtype=torch.uint8, device=x.device)


def stops_its_parent(x, weight, eps):
    """SIGSTOPs the process that forked it (the fork server), then dies."""
    os.kill(os.getppid(), signal.SIGSTOP)
    os._exit(1)


# --- return values -------------------------------------------------------------------------------

def returns_meta(x, weight, eps):
    return torch.empty(x.shape, device="meta")


def returns_sparse(x, weight, eps):
    return _correct(x, weight, eps).to_sparse()


def returns_complex(x, weight, eps):
    return _correct(x, weight, eps).to(torch.complex64)


class Sly(torch.Tensor):
    """A Tensor subclass whose conversions all raise."""

    def to(self, *args, **kwargs):
        raise RuntimeError("no conversions today")

    def cpu(self, *args, **kwargs):
        raise RuntimeError("no conversions today")


def returns_subclass(x, weight, eps):
    """Its values are right: read as a plain tensor, it passes."""
    return _correct(x, weight, eps).as_subclass(Sly)


class Hostile(torch.Tensor):
    """A Tensor subclass every torch function on which raises."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"no {getattr(func, '__name__', func)} today")


def returns_hostile(x, weight, eps):
    return torch.Tensor._make_subclass(Hostile, _correct(x, weight, eps))


def returns_numpy(x, weight, eps):
    return _correct(x, weight, eps).float().numpy()


def returns_none(x, weight, eps):
    return None


def returns_int(x, weight, eps):
    return _correct(x, weight, eps).to(torch.int64)


def returns_huge(x, weight, eps):
    return torch.zeros(x.numel() * 64, dtype=x.dtype)


# --- the sweep's switch --------------------------------------------------------------------------

FAULTS = {
    "raise": lambda x, w, e: (_ for _ in ()).throw(RuntimeError("planted")),
    "exit0": os_exit_0, "exit1": os_exit_1, "sys_exit": sys_exit, "keyboard_interrupt": keyboard_interrupt,
    "segfault": segfault, "sigkill": kills_itself, "hang": sleeps_forever, "gil": gil_hog,
    "garbage": writes_to_every_fd, "meta": returns_meta, "sparse": returns_sparse, "complex": returns_complex,
    "subclass": returns_hostile, "numpy": returns_numpy, "none": returns_none, "int": returns_int,
    "huge": returns_huge, "scribble": scribble_weight_then_use, "scribble_after": scribble_after,
    "prints": prints, "fork": forks, "chdir": chdir, "nan": lambda x, w, e: _correct(x, w, e) * float("nan"),
}
_calls = [0]


def misbehave(x, weight, eps, fault="raise", at=1):
    _calls[0] += 1
    if _calls[0] == at:
        return FAULTS[fault](x, weight, eps)
    return _correct(x, weight, eps)


class ExitsInInit(torch.nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        os._exit(3)


# --- forged protocol frames ------------------------------------------------------------------------

def _parent_pipe():
    """The worker's pipe to the parent, found the way hostile code would: up the call stack."""
    frame = sys._getframe()
    while frame is not None:
        if frame.f_code.co_name == "serve" and "wfd" in frame.f_locals:
            return frame.f_locals["wfd"]
        frame = frame.f_back
    raise RuntimeError("no pipe found")


def _forge(fd, header: dict, payload: bytes = b""):
    import json
    import struct

    head = json.dumps(header).encode()
    os.write(fd, struct.pack("<I", len(head)) + head + payload)


FORGERIES = {
    "empty_error": lambda fd: _forge(fd, {"type": "out", "k": 0, "error": "", "nbytes": 0}),
    "unasked_grad": lambda fd: _forge(fd, {"type": "grad", "k": 0, "error": None, "nbytes": 4,
                                           "dx": {"dtype": "float32", "shape": [1]}, "dw": 5}, b"\0" * 4),
    "endless": lambda fd: [_forge(fd, {"type": "out", "k": k, "error": "x", "nbytes": 0}) for k in range(10**6)],
    "huge_payload": lambda fd: _forge(fd, {"type": "out", "k": 0, "error": None, "dtype": "float64",
                                           "shape": [10**9], "nbytes": 8 * 10**9}),
    "lying_shape": lambda fd: _forge(fd, {"type": "out", "k": 0, "error": None, "dtype": "float64",
                                          "shape": [10**6], "nbytes": 8}, b"\0" * 8),
    "bad_dtype": lambda fd: _forge(fd, {"type": "out", "k": 0, "error": None, "dtype": "object",
                                        "shape": [1], "nbytes": 8}, b"\0" * 8),
    "deep_json": lambda fd: os.write(fd, __import__("struct").pack("<I", 60000) + b"[" * 60000),
    "not_a_dict": lambda fd: _forge(fd, [1, 2, 3]),
}


def forge(x, weight, eps, frame="empty_error"):
    """Writes a forged frame on the parent's pipe, then returns a correct answer."""
    FORGERIES[frame](_parent_pipe())
    return _correct(x, weight, eps)
