"""Property: whatever a code dir holds, no secret-looking file leaves this machine without its --include-secret,
every other file still does, and each one left out is named; on both ways out: the Kaggle kernel's code archive
(folder.pack_code) and `onboxctl push`'s rsync (code_selection's filters, through a real local rsync).

The trees are drawn from two pools known by construction, not by the classifier under test: secret-looking names
(`.env*`, keys, ssh keys, credential files, anything under `.ssh/`, `.git/`, `.aws/`, ...) and legit ones (random
code and data names, and look-alikes: `src/keyboard.py`, `environment.py`, `tokenizer.json`, `id_map.csv`,
`id_rsa.pub`, `.env.example`), in random directories, with names rsync treats specially (`*`, `[`, `?`, `\\`, a
space, a newline).
"""
from __future__ import annotations

import io
import os
import re
import subprocess
import tarfile
import tempfile
from typing import Any, Dict, List, Set, Tuple

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from controller.kaggle import folder
from controller.launch.push import code_filter_args, code_selection
from controller.launch.secretfiles import Selection

word = st.from_regex(r"[a-z][a-z0-9]{0,5}", fullmatch=True)
dirs = st.lists(st.from_regex(r"d[a-z0-9]{0,4}", fullmatch=True), max_size=2).map("/".join)
LOOK_ALIKES = ["keyboard.py", "environment.py", "environment.yml", "tokenizer.json", "id_map.csv", "id_rsa.pub",
               "id_ed25519.pub", ".env.example", ".env.sample", "credentials.py", "secret_sauce.py", "keys.py",
               "monkey.pem.py", "pem.txt", "token_utils.py", "kaggle_utils.py", "secretary.txt", "docker/config.json",
               "a b.py", "w*[x].py", "q?.txt", "back\\slash.py", "nl\nx.py", "ok[1].csv", "ssh.py", ".gitignore.bak"]
# a conservative filter for the random names: nothing that even resembles a secret-looking name is drawn as legit
RESEMBLES = re.compile(r"^(id_|kaggle\.json|credential|secret|client_secret|service|token|api|hf_|access_)|"
                       r"_(rsa|dsa|ecdsa|ed25519)$|\.(pem|key|p12|pfx|ppk|jks|keystore|kdbx|ovpn|tfstate|tfvars|env)$")
legit_names = st.one_of(
    st.from_regex(r"[a-z][a-z0-9_]{0,7}\.(py|csv|md|txt|yaml|json|bin|pt|cfg)", fullmatch=True).filter(
        lambda n: not RESEMBLES.search(n)),
    st.sampled_from(LOOK_ALIKES))
secret_names = st.one_of(
    st.sampled_from([".env", ".envrc", "kaggle.json", ".netrc", "_netrc", ".pypirc", ".pgpass", ".git-credentials",
                     "credentials", "credentials.json", "secrets.toml", "token.json", "id_rsa", "id_ed25519",
                     "id_ecdsa_sk", ".npmrc", ".dockercfg", "terraform.tfstate", "sp ace.env", "w*[x].pem",
                     "q?.key", "back\\slash.p12", "nl\nx.pem"]),
    word.map(lambda w: ".env." + w).filter(lambda n: n not in (".env.example", ".env.sample", ".env.dist")),
    word.map(lambda w: w + ".env"),
    st.tuples(word, st.sampled_from([".pem", ".key", ".p12", ".pfx", ".PEM", ".Key", ".ppk", ".jks"])).map("".join),
    word.map(lambda w: "id_rsa_" + w),
    word.map(lambda w: w + "_ed25519"),
    st.tuples(st.sampled_from([".ssh/", ".git/", ".aws/", ".gnupg/", ".kaggle/", ".kube/"]),
              st.one_of(word, st.sampled_from(["id_rsa.pub", "config", "keyboard.py"]))).map("".join),
)
entries = st.lists(st.tuples(dirs, st.booleans(), st.data()), min_size=1, max_size=10)
LEGIT_BYTES = b"print('fine')\n"
SECRET_BYTES = b"KEY=hunter2\n"  # no certificate: a .pem of it is a key file, not a CA bundle


@st.composite
def code_trees(draw: Any) -> Tuple[Dict[str, bool], Set[str]]:
    """{relative path: is secret-looking} and the secret paths to include."""
    files: Dict[str, bool] = {}
    for parent, secret, data in draw(entries):
        name = data.draw(secret_names if secret else legit_names)
        rel = "/".join(p for p in (parent, name) if p)
        if any(rel.startswith(f + "/") or f.startswith(rel + "/") for f in files):
            continue  # a name both a file and a directory: drawn again next time
        files[rel] = secret
    secrets = sorted(r for r, s in files.items() if s)
    include = set(draw(st.lists(st.sampled_from(secrets), max_size=2, unique=True))) if secrets else set()
    return files, include


def write(root: str, files: Dict[str, bool]) -> None:
    for rel, secret in files.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(SECRET_BYTES if secret else LEGIT_BYTES)


def named(sel: Selection, rel: str) -> bool:
    return any(f.path == rel or (f.path.endswith("/") and rel.startswith(f.path)) for f in sel.left_out)


def check(sel: Selection, sent: List[str], files: Dict[str, bool], include: Set[str]) -> None:
    want = sorted(r for r, s in files.items() if not s or r in include)
    assert sorted(sent) == want
    for rel, secret in files.items():
        if secret and rel not in include:
            assert named(sel, rel), (rel, sel.left_out)
        if not secret:
            assert not named(sel, rel), (rel, sel.left_out)
    assert sorted(f.path for f in sel.included) == sorted(include)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tree=code_trees())
def test_no_secret_looking_file_is_packed_for_kaggle_without_its_flag_and_every_other_file_is(tree):
    files, include = tree
    event("%d secret(s), %d included" % (sum(files.values()), len(include)))
    with tempfile.TemporaryDirectory(prefix="onbox-secrets-") as root:
        write(root, files)
        sel = Selection(root, sorted(include))
        archive = folder.pack_code(root, sel)
        sel.finish()
        with tarfile.open(fileobj=io.BytesIO(archive), mode="r:gz") as t:
            check(sel, t.getnames(), files, include)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tree=code_trees())
def test_no_secret_looking_file_is_rsynced_to_a_box_without_its_flag_and_every_other_file_is(tree):
    files, include = tree
    with tempfile.TemporaryDirectory(prefix="onbox-secrets-") as tmp:
        root, box = os.path.join(tmp, "code"), os.path.join(tmp, "box")
        os.makedirs(root)
        write(root, files)
        sel, excludes = code_selection(root, sorted(include))
        subprocess.run(["rsync", "-a", *code_filter_args(root, excludes), root + "/", box + "/"], check=True,
                       timeout=60, stdin=subprocess.DEVNULL)
        sent = [os.path.relpath(os.path.join(d, f), box) for d, _, fs in os.walk(box) for f in fs]
        check(sel, sent, files, include)
