#!/usr/bin/env bash
# The device check's entry point on the GPU machine (issue 40): run.py with the Python there.
#   bash BUNDLE/scripts/run.sh --bundle BUNDLE --out $OUT [--cpu]
exec "${PYTHON:-python3}" "$(dirname "${BASH_SOURCE[0]}")/run.py" "$@"
