"""One line for bench/gpu_check.sh: a spec-only prediction (`analysis simulate SPEC --json`, every compute event
from the device model) against the run `analysis validate --json` measured, and the profiled prediction beside it.

    python bench/spec_only_check.py SPEC_ONLY.json VALIDATE.json
"""
from __future__ import annotations

import json
import sys


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    try:
        spec_only, validated = (json.loads(open(path).read()) for path in argv)
        predicted, measured = spec_only["batch_time_s"], validated["measured_batch_time_s"]
        profiled = validated["predicted_batch_time_s"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"spec_only_check: cannot read {argv[0]} and {argv[1]} as simulate and validate JSON: {exc}",
              file=sys.stderr)
        return 2
    print(f"spec-only {predicted * 1e3:.3f} ms ({100 * (predicted - measured) / measured:+.1f}%), profiled "
          f"{profiled * 1e3:.3f} ms ({100 * (profiled - measured) / measured:+.1f}%), the run {measured * 1e3:.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
