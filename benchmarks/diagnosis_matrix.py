"""The diagnosis confusion matrix of issue 13: every case of tests/diagnosis_panel.py (single
planted faults and pairs, llama/gemma/LayerNorm, float32/bfloat16/float16, and issue 23's
hairline cases) through `parity`, and per case the planted factors that were named, missed,
the wrong codes, and the variants a `marginal` diagnosis lists.

    python benchmarks/diagnosis_matrix.py                  # this tree
    python benchmarks/diagnosis_matrix.py --tree OLD_DIR   # another checkout's parity_cli, same panel
"""

import argparse
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", default=None, help="a checkout whose parity_cli to run (default: this one)")
    args = ap.parse_args(argv)
    if args.tree:
        sys.path.insert(0, str(Path(args.tree).resolve()))
    sys.path.insert(0, str(HERE.parent / "tests"))
    import diagnosis_panel
    from diagnosis_panel import PANEL, case_id, codes_for, run_case, score

    import parity_cli

    print(f"parity_cli from {Path(parity_cli.__file__).parent}")
    root = tempfile.mkdtemp(prefix="parity-matrix-")
    totals = {"cases": 0, "exact": 0, "missed": 0, "wrong": 0, "vague": 0, "false_alarm": 0, "marginal": 0}
    print("| case | planted | expected | named | missed | wrong codes (confident) | vague | marginal lists |")
    print("|---|---|---|---|---|---|---|---|")
    t0 = time.perf_counter()
    for case in PANEL:
        listed = []
        try:
            got, expected = run_case(case, root, listed)
        except TypeError:  # an older panel
            got, expected = run_case(case, root)
        found, missed, wrong, vague, alarm = score(got, expected)
        totals["cases"] += 1
        totals["missed"] += len(missed)
        totals["wrong"] += len(wrong)
        totals["vague"] += bool(vague)
        totals["false_alarm"] += alarm
        totals["exact"] += not missed and not wrong and not alarm
        totals["marginal"] += "marginal" in found
        planted = ", ".join(sorted(codes_for(case[3], case[0], case[2]))) or "(correct)"
        if getattr(diagnosis_panel, "HAIRLINE_KEYS", None) and case[3].partition("=")[0] in diagnosis_panel.HAIRLINE_KEYS:
            planted = case[3]  # the fault itself: its expected code is the next column
        shown = ", ".join(sorted(expected)) or "-"
        lists = "; ".join(dict.fromkeys(listed)) or "-"
        print(f"| {case_id(case)} | {planted} | {shown} | {', '.join(sorted(found)) or '-'} "
              f"| {', '.join(sorted(missed)) or '-'} "
              f"| {', '.join(sorted(wrong)) or ('false alarm' if alarm else '-')} | {', '.join(sorted(vague)) or '-'} "
              f"| {lists} |")
    print(f"\n{totals['cases']} cases: {totals['exact']} named exactly; {totals['missed']} planted factor(s) missed; "
          f"{totals['wrong']} wrong confident code(s); {totals['vague']} case(s) left vague; "
          f"{totals['marginal']} marginal (at the hairline, no cause picked); "
          f"{totals['false_alarm']} false alarm(s) on correct "
          f"implementations ({time.perf_counter() - t0:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
