#!/usr/bin/env bash
# Persist snapshots to S3 (or any S3-compatible store) and resume a new job from them.
#
#   BUCKET=my-bucket ./examples/s3_checkpoints.sh
#   BUCKET=ckpt S3_ENDPOINT_URL=http://minio:9000 ./examples/s3_checkpoints.sh     # MinIO, Ceph, R2...
#   BUCKET=my-bucket EXPECTED_OWNER=111122223333 ./examples/s3_checkpoints.sh
#
# Credentials come from the standard AWS chain, exactly as for the aws CLI: AWS_ACCESS_KEY_ID /
# AWS_SECRET_ACCESS_KEY (/ AWS_SESSION_TOKEN), AWS_PROFILE with ~/.aws/credentials or SSO, web
# identity (EKS IRSA / Pod Identity), or the ECS / EC2 instance role. resilrun takes no keys on its
# command line and never prints them in errors. The region comes from AWS_REGION / AWS_DEFAULT_REGION
# or the profile.
#
# Every worker writes its own shard (step_<12 digits>/rank_<5 digits>.safetensors + .json) and the
# step counts only once COMPLETE.json exists; the newest KEEP_LAST complete steps are kept.
# Run the script twice: the second job finds the steps the first one persisted and resumes from them.
set -euo pipefail

: "${BUCKET:?set BUCKET to the bucket name (it must exist)}"
PREFIX=${PREFIX:-resilrun/example-job}      # stable: a new job with the same prefix resumes from it
NPROC=${NPROC:-2}
STEPS=${STEPS:-100}
PERSIST_EVERY=${PERSIST_EVERY:-10}
KEEP_LAST=${KEEP_LAST:-3}
RESILRUN=${RESILRUN:-resilrun}              # e.g. RESILRUN="python -m resilrun"

s3_flags=()
# An S3-compatible endpoint (MinIO, Ceph RGW, R2, a VPC endpoint); unset for AWS S3 itself.
if [[ -n "${S3_ENDPOINT_URL:-}" ]]; then s3_flags+=(--s3-endpoint-url "$S3_ENDPOINT_URL"); fi
# The AWS account that must own the bucket: sent as ExpectedBucketOwner on every request, so a
# bucket of the same name in someone else's account is refused instead of written to.
if [[ -n "${EXPECTED_OWNER:-}" ]]; then s3_flags+=(--s3-expected-owner "$EXPECTED_OWNER"); fi

uri="s3://${BUCKET}/${PREFIX}"
echo "checkpoints: ${uri} (every ${PERSIST_EVERY} steps, keeping ${KEEP_LAST})" >&2

# shellcheck disable=SC2086  # RESILRUN may be a command with arguments
$RESILRUN --standalone --nproc-per-node "$NPROC" --max-restarts 2 \
    --checkpoint-uri "$uri" "${s3_flags[@]}" \
    --persist-every "$PERSIST_EVERY" --keep-last "$KEEP_LAST" \
    examples/train_checkpointless.py --steps "$STEPS"

# What is in the bucket now, with every checksum verified (add --json for a machine-readable report).
# shellcheck disable=SC2086
$RESILRUN inspect-checkpoint "$uri" "${s3_flags[@]}" --verify
