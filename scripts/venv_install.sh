# Sourced by the setup scripts: `venv_install VENV PIP_INSTALL_ARGS...` installs into VENV.
# With uv (bootstrapped into VENV by pip): the two venvs CI builds took pip 75 s and 99 s of
# CPU on a fresh machine and uv under 10 s, on two cores shared with the tests. uv reads no
# pip.conf, so pip's find-links (where this machine keeps its CPU torch wheel) are passed on.
# uv writes no .pyc (pip compiled every module it installed, most of its CPU): scripts/test.sh
# lets Python cache the modules the suite imports. Where uv cannot be installed or fails, pip
# does the install as before.
venv_install() {
    local venv=$1
    shift
    if [ ! -x "$venv/bin/uv" ]; then
        "$venv/bin/python" -m pip install --quiet --disable-pip-version-check uv >/dev/null 2>&1 || true
    fi
    if [ -x "$venv/bin/uv" ]; then
        local links=() dir
        for dir in $("$venv/bin/python" -m pip config list 2>/dev/null \
            | sed -n "s/^[^=]*find-links='\(.*\)'$/\1/p" | sort -u); do
            links+=(--find-links "$dir")
        done
        "$venv/bin/uv" pip install --quiet --python "$venv/bin/python" "${links[@]}" "$@" && return 0
        echo "venv_install: uv failed; installing with pip: $*" >&2
    fi
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "$@"
}
