#!/usr/bin/env bash
# A provision command for `onboxctl run --recover pool:P --provision ./vastai-provision.sh` on vast.ai.
#
# The contract (README.md, "Leave it running"): rent ONE box, wait until it answers ssh, print ONE JSON line
# {"host", "port", "user", "name"} as the last line on stdout, exit 0. Anything else is a failed try that the keeper
# retries with backoff. The keeper gives ONBOX_RUN, ONBOX_POOL, ONBOX_NODE and ONBOX_PROVISION_KEY; the key is the
# same for every try of one recovery's node, so this script labels the instance with it and, run again (a keeper
# restarted mid-provision), finds that instance instead of renting a second one.
#
# Needs: the vast.ai CLI (`pip install vastai`, `vastai set api-key ...`), python3, ssh with your key loaded (vast.ai
# puts the account's ssh keys on the instance). The keeper never tears a box down: `vastai destroy instance ID`
# when you no longer need it (`onboxctl down NAME` first: it checks that the run's checkpoints are home).
# Settings: VAST_QUERY, VAST_IMAGE, VAST_DISK_GB (defaults below).
set -euo pipefail

KEY=${ONBOX_PROVISION_KEY:?run by onboxctl keep: ONBOX_PROVISION_KEY is not set}
QUERY=${VAST_QUERY:-"gpu_name=A100_SXM4 num_gpus=1 rentable=true reliability>0.98 direct_port_count>=1"}
IMAGE=${VAST_IMAGE:-pytorch/pytorch:2.4.0-cuda12.4-cudnn9-runtime}
DISK=${VAST_DISK_GB:-60}

json() { python3 -c "import json, sys; d = json.load(sys.stdin); print($1)"; }

id=$(vastai show instances --raw | KEY="$KEY" json \
  'next((str(i["id"]) for i in d if i.get("label") == __import__("os").environ["KEY"]), "")')
if [ -z "$id" ]; then
  offer=$(vastai search offers "$QUERY" -o dph --raw | json 'd[0]["id"] if d else ""')
  [ -n "$offer" ] || { echo "no vast.ai offer matches: $QUERY" >&2; exit 1; }
  id=$(vastai create instance "$offer" --image "$IMAGE" --disk "$DISK" --ssh --direct --label "$KEY" --raw \
       | json 'd["new_contract"]')
  echo "rented vast.ai instance $id (offer $offer) for $ONBOX_RUN" >&2
fi

for _ in $(seq 1 55); do  # the keeper's --provision-timeout (default 10m) bounds this too
  read -r status host port < <(vastai show instance "$id" --raw | json \
    '"%s %s %s" % (d.get("actual_status"), d.get("public_ipaddr"), ((d.get("ports") or {}).get("22/tcp") or [{}])[0].get("HostPort"))')
  if [ "$status" = running ] && [ "$port" != None ] &&
     ssh -o BatchMode=yes -o ConnectTimeout=5 -o StrictHostKeyChecking=accept-new -p "$port" "root@$host" true 2>/dev/null; then
    printf '{"host": "%s", "port": %s, "user": "root", "name": "%s"}\n' "$host" "$port" "$KEY"
    exit 0
  fi
  sleep 10
done
echo "vast.ai instance $id did not answer ssh in time; it is still rented (vastai destroy instance $id)" >&2
exit 1
