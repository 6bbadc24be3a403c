#!/usr/bin/env bash
# shellcheck disable=SC2016  # single-quoted $HOME paths expand on the TPU workers, not here
# Train ict-jax on a Cloud TPU VM slice (one host or a multi-host pod slice).
#
#   bash launch/tpu_pod.sh --name ict-v5p --zone us-east5-a --accelerator-type v5p-32 \
#       --config configs/qwen2_5_7b_math.py --workdir gs://BUCKET/runs/ict-7b \
#       -- --config.ict.method=ict --config.mesh.fsdp=-1
#
# Steps, each a gcloud command printed before it runs (`--dry-run` prints them and runs none):
#   1. describe the TPU VM; create it when describe finds none;
#   2. put the code on every worker: `git archive HEAD` + scp, or `git clone --repo URL`;
#   3. install a Python 3.11 venv with requirements.txt and jax[tpu] on every worker (and wandb
#      when the run logs to Weights & Biases: --wandb, or log.wandb_project set in the config
#      file or the train arguments; WANDB_API_KEY, WANDB_ENTITY, WANDB_MODE and WANDB_BASE_URL,
#      when set here, reach the trainer on every worker through a file of mode 600, never a
#      command line);
#   4. start `python -m ict_jax.train` on all workers at once, under nohup, logging to a file, with
#      JAX_PLATFORMS=tpu (a TPU runtime that fails to start is an error, never a run on the CPU)
#      and JAX's persistent compilation cache in --compilation-cache (a restart loads the
#      compiled programs instead of compiling them again);
#   5. follow worker 0's log (Ctrl-C stops following; training keeps running).
# Stop a run with `bash launch/tpu_pod.sh --stop --name NAME --zone ZONE`.
set -euo pipefail

readonly JAX_VERSION="0.10.2"
readonly WANDB_VERSION="0.31.0"  # requirements-dev.txt's pin (tests/test_launch.py checks they agree)
# Weights & Biases settings handed to the workers when set here (never printed: the API key).
readonly WANDB_VARS=(WANDB_API_KEY WANDB_ENTITY WANDB_MODE WANDB_BASE_URL)
readonly PROG="tpu_pod.sh"
# Paths on the workers, relative to the remote $HOME (expanded there, never here).
readonly R_CODE='"$HOME/ict-jax"'
readonly R_VENV='"$HOME/ict-jax-venv"'
readonly R_LOGS='"$HOME/ict-jax-logs"'
readonly R_PIDFILE='"$HOME/ict-jax-logs/train.pid"'
readonly R_TARBALL='"$HOME/ict-jax.tar.gz"'
readonly R_JAX_CACHE='"$HOME/.cache/ict_jax/jax_cache"'
readonly R_WANDB_ENV='"$HOME/.ict-jax-wandb.env"'

usage() {
  cat <<'EOF'
Usage: bash launch/tpu_pod.sh --name NAME --zone ZONE --accelerator-type TYPE \
           --config configs/NAME.py --workdir gs://BUCKET/DIR [options] [-- TRAIN_ARGS...]

Required:
  --name NAME              TPU VM name (lowercase letters, digits, hyphens)
  --zone ZONE              e.g. us-east5-a (v5p), us-west4-a (v5e), us-central2-b (v4)
  --accelerator-type TYPE  e.g. v5litepod-8, v5p-32, v6e-16, v4-8
  --config PATH            config file, relative to the repository root
  --workdir DIR            checkpoints and logs; gs://... on multi-host slices

Options:
  --version RUNTIME        TPU software version; default from TYPE: v6e -> v2-alpha-tpuv6e,
                           v5p -> v2-alpha-tpuv5, v5litepod -> v2-alpha-tpuv5-lite,
                           v2/v3/v4 -> tpu-ubuntu2204-base
  --project PROJECT        Google Cloud project (default: gcloud's configured project)
  --spot                   create a Spot TPU VM
  --reserved               create the TPU VM from a reservation
  --repo URL               git clone URL on every worker instead of copying this checkout
  --branch REF             branch or tag to clone (with --repo)
  --python VERSION         Python for the workers' venv (default 3.11; JAX 0.10 needs >= 3.11)
  --wandb                  install wandb on the workers and hand them the W&B settings below
                           (implied when the config file or the train arguments set
                           log.wandb_project)
  --compilation-cache DIR  JAX's persistent compilation cache (JAX_COMPILATION_CACHE_DIR);
                           default WORKDIR/jax_cache for a gs:// workdir (it outlives a
                           deleted Spot VM, and every worker reads what worker 0 writes: JAX
                           writes entries from process 0 only), else ~/.cache/ict_jax/jax_cache
                           on each worker
  --stop                   stop the run started by this script on every worker, then exit
  --dry-run                print every command (prefixed '+ ') and run none
  -h, --help               this help

Everything after `--` goes to `python -m ict_jax.train` unchanged, e.g.
  -- --config.model.path=/home/$USER/Qwen2.5-7B --config.mesh.fsdp=-1

Weights & Biases: with --wandb (or log.wandb_project set), the variables WANDB_API_KEY,
WANDB_ENTITY, WANDB_MODE and WANDB_BASE_URL that are set here reach the trainer on every
worker (copied in ~/.ict-jax-wandb.env, mode 600, read and deleted when the run starts; the key
is never on a command line), and W&B's local files go to ~/ict-jax-logs/wandb.
EOF
}

die() { echo "$PROG: error: $*" >&2; exit 2; }
warn() { echo "$PROG: warning: $*" >&2; }

# One word, quoted for bash only when it needs it (so the printed commands can be pasted).
quote_word() {
  local s=$1
  if [[ $s =~ ^[A-Za-z0-9_./:=@%+,-]+$ ]]; then
    printf '%s' "$s"
  else
    printf "'%s'" "${s//\'/\'\\\'\'}"
  fi
}

quote_words() {
  local out="" w
  for w in "$@"; do out+="${out:+ }$(quote_word "$w")"; done
  printf '%s' "$out"
}

DRY_RUN=0
run() {
  echo "+ $(quote_words "$@")"
  if (( ! DRY_RUN )); then "$@"; fi
}

# ---------------------------------------------------------------------------- flags
NAME="" ZONE="" ACCEL="" VERSION="" PROJECT="" CONFIG="" WORKDIR="" REPO="" BRANCH="" JAX_CACHE=""
PYTHON_VERSION="3.11" SPOT=0 RESERVED=0 STOP=0 WANDB=0
TRAIN_ARGS=()
while (( $# )); do
  flag=$1 value="" has_value=0 nshift=1
  if [[ $flag == --*=* ]]; then value=${flag#*=} flag=${flag%%=*} has_value=1; fi
  case $flag in
    --name|--zone|--accelerator-type|--version|--project|--config|--workdir|--repo|--branch|--python|--compilation-cache)
      if (( ! has_value )); then
        (( $# >= 2 )) || die "$flag needs a value"
        value=$2 nshift=2
        [[ $value != --* ]] || die "$flag needs a value, got the flag '$value'"
      fi
      [[ -n $value ]] || die "$flag needs a non-empty value"
      case $flag in
        --name) NAME=$value ;;
        --zone) ZONE=$value ;;
        --accelerator-type) ACCEL=$value ;;
        --version) VERSION=$value ;;
        --project) PROJECT=$value ;;
        --config) CONFIG=$value ;;
        --workdir) WORKDIR=$value ;;
        --repo) REPO=$value ;;
        --branch) BRANCH=$value ;;
        --python) PYTHON_VERSION=$value ;;
        --compilation-cache) JAX_CACHE=$value ;;
      esac ;;
    --spot|--reserved|--stop|--wandb|--dry-run|-h|--help)
      (( ! has_value )) || die "$flag takes no value"
      case $flag in
        --spot) SPOT=1 ;;
        --wandb) WANDB=1 ;;
        --reserved) RESERVED=1 ;;
        --stop) STOP=1 ;;
        --dry-run) DRY_RUN=1 ;;
        -h|--help) usage; exit 0 ;;
      esac ;;
    --) shift; TRAIN_ARGS=("$@"); break ;;
    *) die "unknown flag '$1' (train arguments go after '--'; see --help)" ;;
  esac
  shift "$nshift"
done

# ---------------------------------------------------------------------------- validation
[[ -n $NAME ]] || die "--name is required (the TPU VM to create or reuse)"
[[ $NAME =~ ^[a-z]([-a-z0-9]*[a-z0-9])?$ ]] \
  || die "--name '$NAME': use lowercase letters, digits and hyphens, starting with a letter"
[[ -n $ZONE ]] || die "--zone is required (e.g. us-east5-a)"

GCLOUD_TPU=(gcloud compute tpus tpu-vm)
LOCATION=(--zone="$ZONE")
if [[ -n $PROJECT ]]; then LOCATION+=(--project="$PROJECT"); fi
STOP_HINT="bash launch/tpu_pod.sh --stop --name $NAME $(quote_words "${LOCATION[@]}")"

if (( STOP )); then
  run "${GCLOUD_TPU[@]}" ssh "$NAME" "${LOCATION[@]}" --worker=all \
    --command="if [ -f $R_PIDFILE ] && kill \$(cat $R_PIDFILE) 2>/dev/null; then echo \"stopped \$(hostname)\"; else echo \"no run on \$(hostname)\"; fi; rm -f $R_PIDFILE"
  exit 0
fi

[[ -n $ACCEL ]] || die "--accelerator-type is required (e.g. v5litepod-8, v5p-32)"
[[ $ACCEL =~ ^([a-z0-9]+)-([0-9]+)$ ]] \
  || die "--accelerator-type '$ACCEL': expected GENERATION-SIZE such as v5p-32 or v5litepod-8"
ACCEL_FAMILY=${BASH_REMATCH[1]} ACCEL_SIZE=${BASH_REMATCH[2]}
if [[ -z $VERSION ]]; then
  case $ACCEL_FAMILY in
    v6e) VERSION=v2-alpha-tpuv6e ;;
    v5p) VERSION=v2-alpha-tpuv5 ;;
    v5litepod) VERSION=v2-alpha-tpuv5-lite ;;
    v2|v3|v4) VERSION=tpu-ubuntu2204-base ;;
    *) die "--version is required for accelerator type '$ACCEL' (see 'gcloud compute tpus tpu-vm versions list')" ;;
  esac
fi
# Slices larger than 8 (chips for v5e/v6e, TensorCores for v2-v5p) span several hosts.
MULTI_HOST=0
if (( ACCEL_SIZE > 8 )); then MULTI_HOST=1; fi

[[ -n $CONFIG ]] || die "--config is required (e.g. configs/qwen2_5_1_5b_math.py)"
[[ $CONFIG != /* ]] || die "--config '$CONFIG': give a path relative to the repository root"
[[ -n $WORKDIR ]] || die "--workdir is required (e.g. gs://BUCKET/runs/NAME)"
if (( MULTI_HOST )) && [[ $WORKDIR != gs://* ]]; then
  warn "--workdir '$WORKDIR' is not gs://... but $ACCEL spans several hosts: every host must" \
       "see the same directory, so each would otherwise write its own partial checkpoint"
fi
(( ! (SPOT && RESERVED) )) || die "--spot and --reserved exclude each other"
[[ -z $BRANCH || -n $REPO ]] || die "--branch needs --repo"
[[ $PYTHON_VERSION =~ ^3\.[0-9]+$ ]] || die "--python '$PYTHON_VERSION': expected e.g. 3.11"
[[ -z $JAX_CACHE || $JAX_CACHE == /* || $JAX_CACHE == gs://* ]] \
  || die "--compilation-cache '$JAX_CACHE': give an absolute path on the workers or gs://..."

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [[ -z $REPO && ! -f $REPO_ROOT/$CONFIG ]]; then
  if (( DRY_RUN )); then
    warn "--config '$CONFIG' is not in $REPO_ROOT; a real run stops here"
  else
    die "--config '$CONFIG' is not in $REPO_ROOT"
  fi
fi

# ---------------------------------------------------------------------------- Weights & Biases
# Asked for by --wandb, by a non-empty log.wandb_project in the train arguments, or by one set to
# a string in the config file (read here: a config that computes it needs --wandb).
for ((i = 0; i < ${#TRAIN_ARGS[@]}; i++)); do
  arg=${TRAIN_ARGS[i]}
  if [[ $arg == --config.log.wandb_project=?* ]] \
    || [[ $arg == --config.log.wandb_project && -n ${TRAIN_ARGS[i + 1]:-} ]]; then
    WANDB=1
  fi
done
if [[ -f $REPO_ROOT/$CONFIG ]] \
  && grep -Eq "wandb_project[[:space:]]*=[[:space:]]*[\"'][^\"']+[\"']" "$REPO_ROOT/$CONFIG"; then
  WANDB=1
fi
WANDB_SET=()
if (( WANDB )); then
  for var in "${WANDB_VARS[@]}"; do
    if [[ -n ${!var:-} ]]; then WANDB_SET+=("$var"); fi
  done
  if [[ -z ${WANDB_API_KEY:-} && ${WANDB_MODE:-} != offline && ${WANDB_MODE:-} != disabled ]]; then
    warn "the run logs to Weights & Biases but WANDB_API_KEY is not set here: the workers log in" \
         "only with credentials of their own (~/.netrc from 'wandb login'), else the trainer stops"
  fi
fi

# ---------------------------------------------------------------------------- remote commands
RUN_ID=$(date -u +%Y%m%d-%H%M%S)
R_LOG="\"\$HOME/ict-jax-logs/train-$RUN_ID.log\""
# Refuse to touch the code of a run that is still going.
R_GUARD="if [ -f $R_PIDFILE ] && kill -0 \$(cat $R_PIDFILE) 2>/dev/null; then echo \"ict-jax: a run is still going on \$(hostname) (pid \$(cat $R_PIDFILE)); stop it with: $STOP_HINT\" >&2; exit 1; fi"

if [[ -n $REPO ]]; then
  CLONE=(git clone --depth=1)
  if [[ -n $BRANCH ]]; then CLONE+=(--branch="$BRANCH"); fi
  CLONE+=("$REPO")
  R_FETCH="$R_GUARD; set -e; rm -rf $R_CODE; $(quote_words "${CLONE[@]}") $R_CODE"
else
  TARBALL="${TMPDIR:-/tmp}/ict-jax-$NAME.tar.gz"
  R_FETCH="$R_GUARD; set -e; rm -rf $R_CODE; mkdir -p $R_CODE; tar -xzf $R_TARBALL -C $R_CODE; rm -f $R_TARBALL"
fi

# Ubuntu 22.04 runtimes ship Python 3.10, JAX 0.10 needs >= 3.11: uv fetches one into a venv.
R_INSTALL="set -e; export PATH=\"\$HOME/.local/bin:\$PATH\"; \
command -v uv >/dev/null || python3 -m pip install --user --quiet --upgrade uv \
|| python3 -m pip install --user --quiet --upgrade --break-system-packages uv; \
[ -x $R_VENV/bin/python ] || uv venv --python $PYTHON_VERSION $R_VENV; \
cd $R_CODE; uv pip install --python $R_VENV/bin/python -r requirements.txt $(quote_word "jax[tpu]==$JAX_VERSION")"
if (( WANDB )); then R_INSTALL+=" $(quote_word "wandb==$WANDB_VERSION")"; fi

TRAIN=(-m ict_jax.train --config "$CONFIG" --workdir "$WORKDIR" "${TRAIN_ARGS[@]}")
# ICT_JAX_DISTRIBUTED=1 asks ict_jax.sharding to call jax.distributed.initialize(): on TPU VMs
# the pod topology comes from the metadata server, not from environment variables.
# JAX_PLATFORMS=tpu: a TPU runtime that does not start (libtpu missing, chips held by another
# process) stops the run with JAX's error instead of training on the host CPU.
if [[ -n $JAX_CACHE ]]; then
  R_CACHE_DIR=$(quote_word "$JAX_CACHE")
elif [[ $WORKDIR == gs://* ]]; then
  R_CACHE_DIR=$(quote_word "${WORKDIR%/}/jax_cache")
else
  R_CACHE_DIR=$R_JAX_CACHE
fi
TRAIN_ENV="PYTHONUNBUFFERED=1 JAX_PLATFORMS=tpu JAX_COMPILATION_CACHE_DIR=$R_CACHE_DIR"
if (( MULTI_HOST )); then TRAIN_ENV+=" ICT_JAX_DISTRIBUTED=1"; fi
# W&B's local files (an offline run, files not yet uploaded) outlive the code folder, replaced at
# every launch; its settings come from the copied file, exported to the trainer only.
R_WANDB=""
if (( WANDB )); then TRAIN_ENV+=" WANDB_DIR=$R_LOGS"; fi
if (( ${#WANDB_SET[@]} )); then
  WANDB_ENV_FILE="${TMPDIR:-/tmp}/ict-jax-$NAME.wandb.env"
  R_WANDB=". $R_WANDB_ENV && rm -f $R_WANDB_ENV && "
fi
R_RUN="$R_GUARD; cd $R_CODE && mkdir -p $R_LOGS && $R_WANDB\
{ nohup env $TRAIN_ENV $R_VENV/bin/python $(quote_words "${TRAIN[@]}") > $R_LOG 2>&1 < /dev/null & \
echo \$! > $R_PIDFILE; }; echo \"started on \$(hostname): pid \$(cat $R_PIDFILE), log\" $R_LOG"
R_TAIL="tail -n +1 -F $R_LOG"

# ---------------------------------------------------------------------------- go
CREATE=("${GCLOUD_TPU[@]}" create "$NAME" "${LOCATION[@]}" --accelerator-type="$ACCEL" --version="$VERSION")
if (( SPOT )); then CREATE+=(--spot); fi
if (( RESERVED )); then CREATE+=(--reserved); fi
DESCRIBE=("${GCLOUD_TPU[@]}" describe "$NAME" "${LOCATION[@]}" --format="value(state)")
if (( DRY_RUN )); then
  echo "# create runs only when describe finds no TPU VM named $NAME"
  run "${DESCRIBE[@]}"
  run "${CREATE[@]}"
elif echo "+ $(quote_words "${DESCRIBE[@]}")" && STATE=$("${DESCRIBE[@]}" 2>/dev/null); then
  echo "# reusing TPU VM $NAME (state ${STATE:-unknown})"
  [[ $STATE == READY ]] || warn "TPU VM $NAME is ${STATE:-in an unknown state}, not READY; a" \
    "preempted Spot VM must be deleted first: gcloud compute tpus tpu-vm delete $NAME $(quote_words "${LOCATION[@]}")"
else
  run "${CREATE[@]}"
fi

SSH_ALL=("${GCLOUD_TPU[@]}" ssh "$NAME" "${LOCATION[@]}" --worker=all)
if [[ -z $REPO ]]; then
  if (( ! DRY_RUN )); then
    git -C "$REPO_ROOT" rev-parse --is-inside-work-tree >/dev/null 2>&1 \
      || die "$REPO_ROOT is not a git checkout; pass --repo URL to clone on the workers instead"
    if [[ -n $(git -C "$REPO_ROOT" status --porcelain --untracked-files=no) ]]; then
      warn "uncommitted changes are not copied: git archive packs HEAD"
    fi
  fi
  run git -C "$REPO_ROOT" archive --format=tar.gz --output="$TARBALL" HEAD
  run "${GCLOUD_TPU[@]}" scp "$TARBALL" "$NAME:ict-jax.tar.gz" "${LOCATION[@]}" --worker=all
fi
run "${SSH_ALL[@]}" --command="$R_FETCH"
run "${SSH_ALL[@]}" --command="$R_INSTALL"
if (( ${#WANDB_SET[@]} )); then
  echo "# ${WANDB_SET[*]} from here go to every worker in ~/.ict-jax-wandb.env (mode 600, deleted" \
       "when the run starts), written to $WANDB_ENV_FILE and deleted after the copy"
  if (( ! DRY_RUN )); then
    trap 'rm -f "$WANDB_ENV_FILE"' EXIT
    (
      umask 077
      for var in "${WANDB_SET[@]}"; do printf 'export %s=%s\n' "$var" "$(quote_word "${!var}")"; done \
        > "$WANDB_ENV_FILE"
    )
  fi
  run "${GCLOUD_TPU[@]}" scp "$WANDB_ENV_FILE" "$NAME:.ict-jax-wandb.env" "${LOCATION[@]}" --worker=all
  run rm -f "$WANDB_ENV_FILE"
fi
run "${SSH_ALL[@]}" --command="$R_RUN"
echo "# following worker 0's log; Ctrl-C stops following, training keeps running." \
     "Stop it with: $STOP_HINT"
run "${GCLOUD_TPU[@]}" ssh "$NAME" "${LOCATION[@]}" --worker=0 --command="$R_TAIL"
