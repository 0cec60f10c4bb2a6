# Sourced by the scripts (not run): which python3 they use. setup.sh makes a virtual environment in .venv/ (git-ignored)
# when the python3 on PATH refuses pip installs (PEP 668 "externally managed": the system python3 of Debian 12 and of
# recent Ubuntu) and something has to be installed; every script then puts .venv/bin first on PATH, unless a virtual
# environment is already active. Without .venv this changes nothing.
machmoe_use_venv() {
  local venv="$1/.venv"
  if [ -z "${VIRTUAL_ENV:-}" ] && [ -x "$venv/bin/python3" ]; then
    export VIRTUAL_ENV="$venv"
    export PATH="$venv/bin:$PATH"
  fi
}

# True when the python3 on PATH is an externally managed interpreter outside any virtual environment.
machmoe_python_externally_managed() {
  python3 - <<'PY' >/dev/null 2>&1
import os, sys, sysconfig
in_venv = sys.prefix != sys.base_prefix
marker = os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")
sys.exit(0 if not in_venv and os.path.exists(marker) else 1)
PY
}
