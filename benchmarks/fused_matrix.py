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
    from fused_panel import PANEL, expected, kernels, run_case

    module = kernels()
    totals = {"cases": 0, "exact": 0, "missed": 0, "wrong": 0, "false_alarm": 0}
    print("| kernel | dtype | width | expected | named | missed | wrong |")
    print("|---|---|---|---|---|---|---|")
    t0 = time.perf_counter()
    for case in PANEL:
        got, want = run_case(case, module), expected(case[0], case[1])
        missed, wrong = want - got, got - want
        totals["cases"] += 1
        totals["missed"] += len(missed)
        totals["wrong"] += len(wrong)
        totals["false_alarm"] += bool(got) and not want
        totals["exact"] += got == want
        print(f"| {case[0]} | {case[1]} | {case[2]} | {', '.join(sorted(want)) or '(correct)'} | "
              f"{', '.join(sorted(got)) or '-'} | {', '.join(sorted(missed)) or '-'} | {', '.join(sorted(wrong)) or '-'} |")
    from fused_panel import QUANT_PANEL, quant_expected, quant_kernels, run_quant_case

    module = quant_kernels()
    for case in QUANT_PANEL:
        got, want = run_quant_case(case, module), quant_expected(case[0], case[2])
        missed, wrong = want - got, got - want
        totals["cases"] += 1
        totals["missed"] += len(missed)
        totals["wrong"] += len(wrong)
        totals["false_alarm"] += bool(got) and not want
        totals["exact"] += got == want
        print(f"| quant: {case[0]} | {case[1]} | {case[2]} scale | {', '.join(sorted(want)) or '(correct)'} | "
              f"{', '.join(sorted(got)) or '-'} | {', '.join(sorted(missed)) or '-'} | {', '.join(sorted(wrong)) or '-'} |")
    print(f"\n{totals['cases']} cases: {totals['exact']} named exactly; {totals['missed']} missed; {totals['wrong']} "
          f"wrong code(s); {totals['false_alarm']} false alarm(s) ({time.perf_counter() - t0:.1f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
