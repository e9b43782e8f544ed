#!/usr/bin/env bash
# All the tests, set-up included: bash scripts/run_tests.sh [extra pytest arguments]
# Runs every test in tests/, the slow end-to-end ones too (tiny budgets), then builds the
# documentation with --strict (any warning fails).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"

# -m "slow or not slow": run the slow tests too, whatever a configuration file deselects.
# -n: one pytest worker per CPU core (pytest-xdist; PYTEST_WORKERS overrides, 0 runs in this
# process), each test file on one worker (--dist loadfile: a file's fixtures and its
# end-to-end runs stay together).
python -m pytest tests -m "slow or not slow" -n "${PYTEST_WORKERS:-auto}" --dist loadfile \
    --durations=25 "$@"
mkdocs build --strict --quiet --site-dir site
echo "[docs] mkdocs build --strict: ok (site/)"
