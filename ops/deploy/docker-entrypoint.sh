#!/bin/sh
# The kinfer image's entrypoint: secrets from files into the environment, then the command.
#
# kinfer reads its credentials from the environment (topics/connect.py, topics/auth.py); in a
# container they come as files instead (docker-compose.yml: each principal's own secrets volume),
# named by *_FILE variables, so no password is written in a compose file or an `inspect`:
#
#   KINFER_KAFKA_PASSWORD_FILE  -> KINFER_KAFKA_PASSWORD
#   KINFER_SIGNING_SECRET_FILE  -> KINFER_SIGNING_SECRET
#   KINFER_REDIS_PASSWORD_FILE  -> the password in KINFER_REDIS_URL, whose user it completes:
#                                  redis://USER@host:port/db -> redis://USER:PASSWORD@host:port/db
#
# Without any of them it only runs the command (Kubernetes' `command:` bypasses it altogether).
set -eu

from_file() {  # from_file NAME: NAME=<contents of the file $NAME_FILE names>, when NAME_FILE is set
    eval "file=\${${1}_FILE:-}"
    if [ -n "$file" ]; then
        if [ ! -r "$file" ]; then
            echo "docker-entrypoint: ${1}_FILE=$file cannot be read" >&2
            exit 2
        fi
        value=$(cat "$file")
        export "$1=$value"
        unset "${1}_FILE"
    fi
}

from_file KINFER_KAFKA_PASSWORD
from_file KINFER_SIGNING_SECRET
from_file KINFER_REDIS_PASSWORD

if [ -n "${KINFER_REDIS_PASSWORD:-}" ]; then
    url="${KINFER_REDIS_URL:-}"
    scheme="${url%%://*}"
    rest="${url#*://}"
    user="${rest%%@*}"
    case "$url" in
        *://*@*) ;;
        *) user="" ;;
    esac
    case "$user" in
        "" | *:*)
            echo "docker-entrypoint: KINFER_REDIS_PASSWORD_FILE needs KINFER_REDIS_URL with a user and no" \
                 "password (redis://USER@host:port/db)" >&2
            exit 2
            ;;
    esac
    KINFER_REDIS_URL="$scheme://$user:$KINFER_REDIS_PASSWORD@${rest#*@}"
    export KINFER_REDIS_URL
    unset KINFER_REDIS_PASSWORD
fi

exec "$@"
