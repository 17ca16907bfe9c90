# Shared by scripts/gpu_*_runs.sh (source it): `run NAME LIMIT_S CMD...` runs CMD with its own timeout into
# $OUT/NAME.log, skips it when ONLY names other runs or when the script's BUDGET_S is spent, and prints the
# log's lines matching $SHOW. Needs OUT, BUDGET_S, T0 and SHOW set by the caller.
MIN_LEFT=${MIN_LEFT:-30}

run() {   # run NAME LIMIT_S CMD...
  local name=$1 limit=$2; shift 2
  if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then return; fi
  local left=$(( BUDGET_S - ($(date +%s) - T0) ))
  if [ "$left" -lt "$MIN_LEFT" ]; then echo "== $name: skipped (${left} s of the budget left)"; return; fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "== $name (limit ${limit} s): $*"
  local t=$(date +%s)
  timeout -k 5 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name: rc=$rc in $(( $(date +%s) - t )) s"
  grep -E "$SHOW" "$OUT/$name.log" | grep -v Warning | tail -n 24
}
