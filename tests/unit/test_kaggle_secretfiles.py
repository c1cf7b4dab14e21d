"""Secret-looking files of a code dir that leaves this machine (controller/launch/secretfiles.py): the names and contents
that are left out, the look-alikes that are not, --include-secret, and both ways out: the Kaggle kernel's code
archive (folder.pack_code) and the rsync of `onboxctl push` (a real local rsync with the push's own filters)."""
from __future__ import annotations

import io
import os
import subprocess
import tarfile

import pytest

from controller.kaggle import folder
from controller.launch import secretfiles
from controller.launch.push import code_filter_args, code_selection
from controller.launch.secretfiles import Selection
from onbox.errors import UsageError

SECRETS = [".env", ".env.local", ".env.production", ".envrc", "prod.env", "deploy/.env", "kaggle.json",
           ".kaggle/kaggle.json", ".ssh/id_rsa", "x/.ssh/config", "id_rsa", "id_ed25519", "id_ecdsa_sk",
           "id_rsa_github", "id_rsa.bak", "deploy_rsa", "server.pem", "SERVER.PEM", "tls.key", "a.p12", "a.pfx",
           "putty.ppk", "store.jks", ".netrc", "_netrc", ".pgpass", ".pypirc", ".npmrc", ".git-credentials",
           ".dockercfg", ".docker/config.json", ".s3cfg", ".boto", "credentials", "credentials.json",
           "application_default_credentials.json", ".git/config", "sub/.git/HEAD", ".aws/credentials",
           ".aws/config", ".gnupg/pubring.kbx", "secrets.toml", ".streamlit/secrets.toml", "token.json", "token",
           "hf_token", "api_key.txt", "client_secret_1.apps.googleusercontent.com.json", "service-account.json",
           "service_account_key.json", "terraform.tfstate", "x.tfstate.backup", "prod.tfvars", ".bash_history",
           "vpn.ovpn", "db.kdbx"]
LEGIT = ["src/keyboard.py", "environment.py", "environment.yml", "tokenizer.json", "tokenizer_config.json",
         "id_map.csv", "id_rsa.pub", "id_ed25519-cert.pub", "credentials.py", "secret_sauce.py", "secrets.py",
         ".env.example", ".env.sample", ".env.template", "env.py", "secretary.txt", "tokens.txt", "config.json",
         "docker/config.json", "keys.py", "monkey.py", "pem.txt", "id_rsa_test.py", "data/id.csv", ".gitignore",
         ".github/workflows/ci.yml", "credentials.example.json", "key.py", "README.md", ".venv_notes", "keymap.json",
         "src/auth/credentials_loader.py", "tokenizer.model", "vocab.txt", "model.safetensors", "ckpt/step_10.pt",
         "gitignore.txt", "ssh.py", "aws_utils.py", "kaggle_utils.py", "kaggle.yaml", "netrc_parser.py"]


@pytest.mark.parametrize("rel", SECRETS)
def test_a_secret_looking_path_is_named_with_why(rel):
    assert secretfiles.reason(rel)


@pytest.mark.parametrize("rel", LEGIT)
def test_a_look_alike_is_a_file_like_any_other(rel):
    assert secretfiles.reason(rel) is None


B64 = b"b3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAAEbm9uZQAAAAAAAAABAAAAMwAAAAtzc2gtZW"  # a key's first line


def test_a_pem_private_key_is_found_by_its_content_under_any_name_and_a_mention_in_code_is_not():
    assert secretfiles.content_reason(b"-----BEGIN OPENSSH PRIVATE KEY-----\n" + B64 + b"\n-----END OPENSSH")
    assert secretfiles.content_reason(b"x\n-----BEGIN RSA PRIVATE KEY-----\r\n" + B64 + b"\r\n")
    assert secretfiles.content_reason(b"-----BEGIN RSA PRIVATE KEY-----\nProc-Type: 4,ENCRYPTED\nDEK-Info: AES-128-CBC,"
                                      b"00\n\n" + B64 + b"\n")
    assert secretfiles.content_reason(b"-----BEGIN PGP PRIVATE KEY BLOCK-----\nComment: x\n\n" + B64 + b"\n")
    assert secretfiles.content_reason(b'{"type": "service_account", "private_key": "-----BEGIN PRIVATE KEY-----\\n'
                                      + B64 + b'"}')
    # code that looks for keys, or a test that spells a header: no key material, no secret
    assert secretfiles.content_reason(b'HEADER = "-----BEGIN RSA PRIVATE KEY-----"\n') is None
    assert secretfiles.content_reason(b"-----BEGIN RSA PRIVATE KEY-----\nMIIE\n") is None
    assert secretfiles.content_reason(b'{"private_key": "-----BEGIN PRIVATE KEY-----\\n..."}') is None
    assert secretfiles.content_reason(b"-----BEGIN CERTIFICATE-----\n" + B64 + b"\n-----END CERTIFICATE-----") is None
    assert secretfiles.content_reason(b"print('hello')\n") is None


def tree(root, files):
    for rel, data in files.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data if isinstance(data, bytes) else data.encode())


def names_in(archive):
    with tarfile.open(fileobj=io.BytesIO(archive), mode="r:gz") as t:
        return sorted(t.getnames())


CA = b"# Issuer: x\n-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"
KEY = b"-----BEGIN EC PRIVATE KEY-----\n" + B64 + b"\n-----END EC PRIVATE KEY-----\n"
CODE = {"train.py": "x", "src/keyboard.py": "x", "environment.py": "x", "tokenizer.json": "{}", "id_map.csv": "1",
        ".env": "KEY=v", "kaggle.json": '{"username": "u", "key": "k"}', ".ssh/id_rsa": "k", ".ssh/id_rsa.pub": "p",
        ".git/config": "[remote]", "vendor/certifi/cacert.pem": CA, "notes/server": KEY, "cert-and-key.pem": CA + KEY}


def test_pack_code_leaves_out_and_names_every_secret_looking_file_and_packs_every_other(tmp_path):
    tree(str(tmp_path / "c"), CODE)
    sel = Selection(str(tmp_path / "c"))
    archive = folder.pack_code(str(tmp_path / "c"), sel)
    assert names_in(archive) == ["environment.py", "id_map.csv", "src/keyboard.py", "tokenizer.json", "train.py",
                                 "vendor/certifi/cacert.pem"]
    assert sorted(f.path for f in sel.finish().left_out) == [".env", ".git/", ".ssh/", "cert-and-key.pem",
                                                             "kaggle.json", "notes/server"]
    assert sel.included == []
    (line,) = sel.summary("--code c")
    assert "left out 6 secret-looking path(s) of --code c" in line and "kaggle.json (Kaggle API credentials)" in line


def test_include_secret_packs_exactly_what_it_names_and_an_include_that_names_nothing_is_refused(tmp_path):
    root = str(tmp_path / "c")
    tree(root, CODE)
    sel = Selection(root, [".env", ".ssh/id_rsa", os.path.join(root, "notes", "server")])
    got = names_in(folder.pack_code(root, sel))
    sel.finish()
    assert {".env", ".ssh/id_rsa", "notes/server"} <= set(got) and ".ssh/id_rsa.pub" not in got
    assert sorted(f.path for f in sel.included) == [".env", ".ssh/id_rsa", "notes/server"]
    assert ".ssh/id_rsa.pub" in [f.path for f in sel.left_out]  # the rest of .ssh/ still stays home
    whole = Selection(root, [".git"])
    assert ".git/config" in names_in(folder.pack_code(root, whole)) and whole.finish().included[0].path == ".git/"
    for wrong, says in (("train.py", "names no secret-looking file"), ("nope", "names no secret-looking file"),
                        ("../x", "names no file inside"), ("/etc/passwd", "is not inside the code directory")):
        with pytest.raises(UsageError, match=says):
            sel = Selection(root, [wrong])
            folder.pack_code(root, sel)
            sel.finish()


def test_the_push_to_a_box_sends_what_rsync_would_minus_the_secrets_and_its_filters_leave_them_out(tmp_path):
    root = str(tmp_path / "c")
    odd = {"w*[x.pem": "k", "b\\s.key": "k", "nl\nx.env": "k", "q?.pem": "k", "sp ace/.env": "k",
           "ignored/.env": "k", ".gitignore": "ignored/\n*.log\n", "run.log": "x", "ok[1].py": "x"}
    tree(root, {**CODE, **odd})
    sel, excludes = code_selection(root, include=["kaggle.json"])
    assert "ignored/.env" not in [f.path for f in sel.left_out]  # never sent anyway: .gitignore'd, not named
    assert "kaggle.json" in [f.path for f in sel.included]
    dest = str(tmp_path / "box")
    subprocess.run(["rsync", "-a", *code_filter_args(root, excludes), root + "/", dest + "/"], check=True,
                   timeout=60)
    sent = sorted(os.path.relpath(os.path.join(d, f), dest) for d, _, fs in os.walk(dest) for f in fs)
    assert sent == [".gitignore", "environment.py", "id_map.csv", "kaggle.json", "ok[1].py", "src/keyboard.py",
                    "tokenizer.json", "train.py", "vendor/certifi/cacert.pem"]
    with pytest.raises(UsageError, match="names no secret-looking file that would be sent"):
        code_selection(root, include=["ignored/.env"])  # .gitignore'd: it would not go, whatever the flag says


def test_a_code_dir_that_is_itself_a_secret_directory_sends_nothing_unless_asked(tmp_path):
    root = str(tmp_path / ".ssh")
    tree(root, {"config": "Host x\n", "known_hosts": "x\n", "id_rsa": "k"})
    sel = Selection(root)
    assert names_in(folder.pack_code(root, sel)) == []
    assert sorted(f.path for f in sel.left_out) == ["config", "id_rsa", "known_hosts"]
    sel = Selection(root, ["config"])
    assert names_in(folder.pack_code(root, sel)) == ["config"]
