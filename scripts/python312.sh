#!/bin/sh
# Prints a Python >= 3.12 interpreter (jax >= 0.11 needs one), or fails saying how to get one.
# Machines of this image have python3 = 3.11 and Python 3.12 under pyenv.
for p in "${PYTHON:-}" python3 python3.14 python3.13 python3.12 \
         $(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.1[2-9]*/bin/python3 2>/dev/null); do
  [ -n "$p" ] || continue
  if "$p" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
    command -v "$p"; exit 0
  fi
done
echo "no Python >= 3.12 found: install one (e.g. pyenv install 3.12) or set PYTHON=/path/to/python3.12" >&2
exit 1
