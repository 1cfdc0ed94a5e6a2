#!/usr/bin/env bash
# A compose Kafka node, broker or controller (apache/kafka image): format the storage once, with every principal's SCRAM
# credential (KIP-900; what `kinfer stack up --secure` does), then run Kafka with the
# server.properties the `secrets` service wrote (python -m kinfer.ops.deploy.secure_init init).
#
# The image's own start script configures Kafka from KAFKA_* variables and formats without
# --add-scram; this one replaces it. KINFER_NODE names the node (its folder in the volume).
set -euo pipefail

node="${KINFER_NODE:?KINFER_NODE must name the node (kafka-1, kafka-controller-1, ...)}"
secrets="${KINFER_KAFKA_SECRETS:-/run/kinfer/kafka}"
config="$secrets/$node/server.properties"
bin="${KAFKA_HOME:-/opt/kafka}/bin"

if [[ ! -r "$config" ]]; then
    echo "kafka-start: cannot read $config as uid $(id -u): the secrets service writes it (docker compose up" \
         "runs it first) for uid 1000 (python -m kinfer.ops.deploy.secure_init init --owner kafka=UID for another)" >&2
    exit 1
fi
data="$(sed -n 's/^log\.dirs=//p' "$config")"
marker="$data/kinfer-secure"  # formatted here, with the SCRAM users (Kafka reads only folders in log.dirs)

if [[ -e "$data/meta.properties" ]]; then
    if [[ ! -e "$marker" ]]; then
        echo "kafka-start: $data was formatted without kinfer's SCRAM users (by an earlier PLAINTEXT" \
             "compose stack?): remove the brokers' volumes (docker compose down -v) and start again" >&2
        exit 1
    fi
else
    mapfile -t scram < "$secrets/scram-args"  # --add-scram and its value, one a line
    "$bin/kafka-storage.sh" format --cluster-id "$(cat "$secrets/cluster-id")" \
        --config "$config" --ignore-formatted "${scram[@]}"
    touch "$marker"
fi

exec "$bin/kafka-server-start.sh" "$config"
