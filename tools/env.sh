# Shared settings for ramjet's scripts. Source it; every value can be overridden from the environment.
RAMJET_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export RAMJET_ROOT
export RAMJET_VENV="${RAMJET_VENV:-$RAMJET_ROOT/.venv}"
export RAMJET_STATE="${RAMJET_STATE:-$RAMJET_ROOT/.ramjet}"
# Local S3 server (SeaweedFS). Credentials default to a fixed pair for the local server only.
export RAMJET_S3_HOST="${RAMJET_S3_HOST:-127.0.0.1}"
export RAMJET_S3_PORT="${RAMJET_S3_PORT:-8333}"
export RAMJET_S3_BUCKET="${RAMJET_S3_BUCKET:-ramjet}"
export AWS_ACCESS_KEY_ID="${AWS_ACCESS_KEY_ID:-ramjet-local}"
export AWS_SECRET_ACCESS_KEY="${AWS_SECRET_ACCESS_KEY:-ramjet-local-secret}"
export AWS_REGION="${AWS_REGION:-us-east-1}"
export AWS_ENDPOINT_URL="${AWS_ENDPOINT_URL:-http://$RAMJET_S3_HOST:$RAMJET_S3_PORT}"
# The ports the tests' daemons are given (tests/src/ports.rs, bindings/tests/ports.py): a band
# of 2,000 below the kernel's ephemeral range (32768-60999), picked by the S3 port, so the runs
# on 8333, 8533, ... (tools/test.sh) have disjoint bands and no outgoing connection takes one.
export RAMJET_TEST_PORTS="${RAMJET_TEST_PORTS:-$((20000 + RAMJET_S3_PORT / 200 % 6 * 2000))-$((21999 + RAMJET_S3_PORT / 200 % 6 * 2000))}"
