#!/usr/bin/env bash
# A real S3 endpoint on 127.0.0.1 for the `s3` tests: Ceph's radosgw (Debian's ceph-mon, ceph-osd,
# radosgw) over one monitor and one memstore OSD (objects in RAM), HTTPS with a self-signed
# certificate (LitData's chunk downloader refuses plain http).
#
#   tests/cluster/s3.sh start    install (Debian, as root) if needed, configure, start; idempotent
#   tests/cluster/s3.sh stop     stop the daemons this script started, by the PIDs they recorded
#   tests/cluster/s3.sh env      print the AWS_* / SSL_CERT_FILE exports a client needs
#
# Everything lives in $VITPIPE_S3_DIR (default /tmp/vitpipe-s3). memstore keeps nothing when a
# daemon dies: a start that finds the cluster gone builds it again, empty.
set -euo pipefail

DIR="${VITPIPE_S3_DIR:-/tmp/vitpipe-s3}"
CONF="$DIR/ceph.conf"
PORT="${VITPIPE_S3_PORT:-7443}"
KEY=vitpipe-test-key
SECRET=vitpipe-test-secret

log() { echo "s3.sh: $*" >&2; }

# shellcheck source=tests/cluster/lib.sh
source "$(dirname "$0")/lib.sh"

install() {
  install_missing "ceph-mon ceph-osd radosgw radosgw-admin monmaptool openssl" ceph-mon ceph-osd radosgw openssl
}

certificate() {  # a CA and a server certificate it signs (rustls, under LitData's obstore, refuses a CA as server)
  [ -s "$DIR/tls/bundle.pem" ] && return 0
  mkdir -p "$DIR/tls"
  (
    cd "$DIR/tls"
    openssl req -x509 -newkey rsa:2048 -nodes -days 30 -subj "/CN=vitpipe test CA" \
      -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
      -keyout ca-key.pem -out ca.pem
    openssl req -newkey rsa:2048 -nodes -subj /CN=localhost -keyout key.pem -out server.csr
    printf '%s\n' "subjectAltName=DNS:localhost,IP:127.0.0.1" "basicConstraints=critical,CA:FALSE" \
      "keyUsage=critical,digitalSignature,keyEncipherment" "extendedKeyUsage=serverAuth" >server.ext
    openssl x509 -req -in server.csr -CA ca.pem -CAkey ca-key.pem -CAcreateserial -days 30 -extfile server.ext \
      -out cert.pem
  ) >"$DIR/log/openssl.log" 2>&1
  # the system's roots plus ours: SSL_CERT_FILE replaces the default bundle for the processes using it
  cat /etc/ssl/certs/ca-certificates.crt "$DIR/tls/ca.pem" >"$DIR/tls/bundle.pem" 2>/dev/null ||
    cp "$DIR/tls/ca.pem" "$DIR/tls/bundle.pem"
}

configure() {
  local fsid
  fsid="$(cat "$DIR/fsid" 2>/dev/null || true)"
  if [ -z "$fsid" ]; then
    fsid="$(cat /proc/sys/kernel/random/uuid)"
    echo "$fsid" >"$DIR/fsid"
  fi
  cat >"$CONF" <<EOF
# written by vitpipe tests/cluster/s3.sh
[global]
fsid = $fsid
mon host = v1:127.0.0.1:6789
public addr = 127.0.0.1
auth cluster required = none
auth service required = none
auth client required = none
osd objectstore = memstore
memstore device bytes = 4294967296
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
osd crush chooseleaf type = 0
mon allow pool size one = true
mon allow pool delete = true
mon warn on pool no redundancy = false
osd class update on start = false
osd crush update on start = false
run dir = $DIR/run
pid file = $DIR/run/\$name.pid
admin socket = $DIR/run/\$name.asok
log file = $DIR/log/\$name.log
mon data = $DIR/mon/\$cluster-\$id
osd data = $DIR/osd/\$cluster-\$id
keyring = $DIR/keyring
[client.rgw.a]
rgw frontends = beast ssl_endpoint=127.0.0.1:$PORT ssl_certificate=$DIR/tls/cert.pem ssl_private_key=$DIR/tls/key.pem
rgw data = $DIR/rgw
rgw dns name = localhost
EOF
}

fresh_cluster() {  # monitor and OSD from nothing (memstore holds no objects across restarts)
  local fsid uuid
  fsid="$(cat "$DIR/fsid")"
  rm -rf "$DIR/mon" "$DIR/osd" "$DIR/rgw" "$DIR/monmap" "$DIR/keyring"
  mkdir -p "$DIR/mon/ceph-a" "$DIR/osd/ceph-0" "$DIR/rgw"
  ceph-authtool --create-keyring "$DIR/keyring" --gen-key -n mon. --cap mon 'allow *' >/dev/null
  monmaptool --create --fsid "$fsid" --add a 127.0.0.1:6789 "$DIR/monmap" >/dev/null
  ceph-mon -c "$CONF" --mkfs -i a --monmap "$DIR/monmap" --keyring "$DIR/keyring"
  ceph-mon -c "$CONF" -i a
  wait_for 30 "ceph-mon" ceph -c "$CONF" --connect-timeout 2 mon stat
  uuid="$(cat /proc/sys/kernel/random/uuid)"
  ceph -c "$CONF" osd new "$uuid" 0 >/dev/null
  # the OSD's own crush commands at start are refused under auth none ("wrong fsid"): place it here
  ceph -c "$CONF" osd crush add osd.0 1.0 root=default >/dev/null 2>&1
  ceph-osd -c "$CONF" -i 0 --mkfs --osd-uuid "$uuid" >"$DIR/log/osd-mkfs.log" 2>&1
}

start() {
  mkdir -p "$DIR"/{run,log}
  install
  certificate
  configure
  if ! alive "$DIR/run/mon.a.pid" || ! alive "$DIR/run/osd.0.pid"; then
    stop_daemons
    fresh_cluster
    ceph-osd -c "$CONF" -i 0 2>>"$DIR/log/osd-start.log"
    wait_for 60 "ceph-osd up" bash -c "ceph -c '$CONF' --connect-timeout 2 osd stat | grep -q '1 up'"
  fi
  if ! alive "$DIR/run/client.rgw.a.pid"; then
    radosgw -c "$CONF" -n client.rgw.a
    wait_for 60 "radosgw on 127.0.0.1:$PORT" bash -c "exec 3<>/dev/tcp/127.0.0.1/$PORT"
  fi
  if ! radosgw-admin -c "$CONF" user info --uid=vitpipe >/dev/null 2>&1; then
    radosgw-admin -c "$CONF" user create --uid=vitpipe --display-name=vitpipe \
      --access-key="$KEY" --secret="$SECRET" >/dev/null
  fi
  log "up: https://127.0.0.1:$PORT (eval \"\$($0 env)\" for the client settings)"
}

stop_daemons() {
  stop_pidfile "$DIR/run/client.rgw.a.pid"
  stop_pidfile "$DIR/run/osd.0.pid"
  stop_pidfile "$DIR/run/mon.a.pid"
}

env_lines() {
  cat <<EOF
export AWS_ENDPOINT_URL=https://127.0.0.1:$PORT
export AWS_ACCESS_KEY_ID=$KEY
export AWS_SECRET_ACCESS_KEY=$SECRET
export AWS_DEFAULT_REGION=us-east-1
export AWS_CA_BUNDLE=$DIR/tls/bundle.pem
export SSL_CERT_FILE=$DIR/tls/bundle.pem
export AWS_REQUEST_CHECKSUM_CALCULATION=when_required
export AWS_RESPONSE_CHECKSUM_VALIDATION=when_required
EOF
}

case "${1:-}" in
  start) start ;;
  stop) stop_daemons; log "stopped" ;;
  env) env_lines ;;
  *) echo "usage: $0 start|stop|env" >&2; exit 2 ;;
esac
