#!/usr/bin/env bash
# The test suite against the next TorchRL: torchrl-nightly with tensordict 0.15.x, in a second venv.
#
# Not part of the default CI (it downloads two wheels). The venv sees this machine's packages
# (torch, transformers, ...) and overrides only torchrl and tensordict:
#
#   bash benchmarks/nightly_suite.sh                 # the whole suite
#   bash benchmarks/nightly_suite.sh -m "not slow"   # extra pytest arguments
#
# torchrl-nightly imports tensordict.utils.is_seq_of_nested_key, which tensordict 0.15 marks as
# deprecated; the suite turns warnings into errors, so that one warning (TorchRL's, not ours)
# is ignored here.
set -euo pipefail
VENV=${NIGHTLY_VENV:-/tmp/ppo_objectives_nightly}
TENSORDICT=${TENSORDICT_VERSION:-0.15.3}
cd "$(dirname "$0")/.."
if [ ! -x "$VENV/bin/python" ]; then
  python -m venv --system-site-packages "$VENV"
  "$VENV/bin/pip" install -q --no-deps "tensordict==$TENSORDICT" torchrl-nightly pyvers hoptorch
fi
"$VENV/bin/python" -c "import torch, tensordict, torchrl; print('torch', torch.__version__, '| tensordict', \
tensordict.__version__, '| torchrl', torchrl.__file__)"
"$VENV/bin/pip" list 2>/dev/null | grep -iE "^(torchrl-nightly|tensordict) " || true
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider \
  -W "ignore:tensordict.utils.is_seq_of_nested_key is deprecated:DeprecationWarning" "$@"
