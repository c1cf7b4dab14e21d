#!/usr/bin/env bash
# A provision command for `onboxctl run --recover pool:P --provision ./runpod-provision.sh` on RunPod.
#
# The contract (README.md, "Leave it running"): rent ONE box, wait until it answers ssh, print ONE JSON line
# {"host", "port", "user", "name"} as the last line on stdout, exit 0. Anything else is a failed try that the keeper
# retries with backoff. The keeper gives ONBOX_RUN, ONBOX_POOL, ONBOX_NODE and ONBOX_PROVISION_KEY; the key is the
# same for every try of one recovery's node, so the pod is named after it and, run again (a keeper restarted
# mid-provision), this script finds that pod instead of renting a second one.
#
# Needs: runpodctl (`runpodctl config --apiKey ...`; the account's ssh public key in RunPod's settings), ssh with
# your key loaded. The pod exposes 22/tcp on a public IP (`--ports 22/tcp`); its address is read from the PORTS column
# of `runpodctl get pod ID --allfields` ("IP:PORT->22 (Pub,TCP)"): check that against your runpodctl's output.
# The keeper never tears a box down: `runpodctl remove pod ID` when you no longer need it (`onboxctl down NAME`
# first: it checks that the run's checkpoints are home).
# Settings: RUNPOD_GPU, RUNPOD_IMAGE, RUNPOD_CLOUD (--communityCloud or --secureCloud), RUNPOD_VOLUME_GB.
set -euo pipefail

KEY=${ONBOX_PROVISION_KEY:?run by onboxctl keep: ONBOX_PROVISION_KEY is not set}
GPU=${RUNPOD_GPU:-"NVIDIA A100 80GB PCIe"}
IMAGE=${RUNPOD_IMAGE:-runpod/pytorch:2.4.0-py3.11-cuda12.4.1-devel-ubuntu22.04}
CLOUD=${RUNPOD_CLOUD:---communityCloud}
VOLUME=${RUNPOD_VOLUME_GB:-100}

pod=$(runpodctl get pod --allfields | awk -v k="$KEY" '$2 == k { print $1; exit }')
if [ -z "$pod" ]; then
  out=$(runpodctl create pod --name "$KEY" --gpuType "$GPU" --imageName "$IMAGE" --containerDiskSize 50 \
        --volumeSize "$VOLUME" --ports "22/tcp" "$CLOUD")
  pod=$(printf '%s\n' "$out" | sed -n 's/.*pod "\([A-Za-z0-9]*\)".*/\1/p' | head -n 1)
  [ -n "$pod" ] || { echo "runpodctl did not create a pod: $out" >&2; exit 1; }
  echo "rented RunPod pod $pod for $ONBOX_RUN" >&2
fi

for _ in $(seq 1 55); do  # the keeper's --provision-timeout (default 10m) bounds this too
  addr=$(runpodctl get pod "$pod" --allfields | grep -o '[0-9][0-9.]*:[0-9]*->22' | head -n 1 || true)
  host=${addr%%:*}
  port=${addr#*:}
  port=${port%%-*}
  if [ -n "$addr" ] &&
     ssh -o BatchMode=yes -o ConnectTimeout=5 -o StrictHostKeyChecking=accept-new -p "$port" "root@$host" true 2>/dev/null; then
    printf '{"host": "%s", "port": %s, "user": "root", "name": "%s"}\n' "$host" "$port" "$KEY"
    exit 0
  fi
  sleep 10
done
echo "RunPod pod $pod did not answer ssh in time; it is still rented (runpodctl remove pod $pod)" >&2
exit 1
