"""The fused kernels' confusion matrix (issue 37): every case of tests/fused_panel.py (each planted
add + norm kernel of tests/plugins/fused_kernels.py at float32/bfloat16/float16, widths 64 and 2048;
each norm + int8 quantize kernel of tests/plugins/quant_kernels.py, static and dynamic scales)
through parity's fused check, the codes named against the codes planted.

    python benchmarks/fused_matrix.py
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def main() -> int:
    from fused_panel import PANEL, kernels, run_case

    modules = {form: kernels(form) for form in ("add", "quant")}
    totals = {"cases": 0, "exact": 0, "missed": 0, "wrong": 0, "false_alarm": 0}
    print("| form | kernel | dtype | width / scale | expected | named | missed | wrong |")
    print("|---|---|---|---|---|---|---|---|")
    t0 = time.perf_counter()
    for case in PANEL:
        form, kernel, dtype, size, want = case
        got = run_case(case, modules)
        missed, wrong = want - got, got - want
        totals["cases"] += 1
        totals["missed"] += len(missed)
        totals["wrong"] += len(wrong)
        totals["false_alarm"] += bool(got) and not want
        totals["exact"] += got == want
        print(f"| {form} | {kernel} | {dtype} | {size} | {', '.join(sorted(want)) or '(correct)'} | "
              f"{', '.join(sorted(got)) or '-'} | {', '.join(sorted(missed)) or '-'} | {', '.join(sorted(wrong)) or '-'} |")
    print(f"\n{totals['cases']} cases: {totals['exact']} named exactly; {totals['missed']} missed; {totals['wrong']} "
          f"wrong code(s); {totals['false_alarm']} false alarm(s) ({time.perf_counter() - t0:.1f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
