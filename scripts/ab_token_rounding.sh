#!/usr/bin/env bash
# The A/B script's old name, kept so that the commands recorded in docs/measurements/ (sessions 48-59) still run.
exec bash "$(dirname "$0")/ab.sh" "$@"
