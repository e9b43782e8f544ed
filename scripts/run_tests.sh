#!/usr/bin/env bash
# All the tests, set-up included: bash scripts/run_tests.sh [extra pytest arguments]
# Runs every test in tests/, the slow end-to-end ones too (tiny budgets), then builds the
# documentation with --strict (any warning fails).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"

# -m "slow or not slow": run the slow tests too, whatever a configuration file deselects.
python -m pytest tests -m "slow or not slow" --durations=25 "$@"
mkdocs build --strict --quiet --site-dir site
echo "[docs] mkdocs build --strict: ok (site/)"
