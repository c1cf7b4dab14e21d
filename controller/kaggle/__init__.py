"""Kaggle kernels as a target (`onboxctl kaggle push|status|logs|pull`).

folder.py writes the kernel folder (kernel-metadata.json and a script carrying onbox.pyz, and the --code tree with
its secret-looking files left out: controller/launch/secretfiles.py); kernel_main.py is the part of that script that runs
on Kaggle (standard library only, never imported by onbox); onboxargs.py checks the session's `onbox run` options
here, with the agent's own parser and validation, before anything is written or sent; cli.py runs the real `kaggle`
CLI through onbox.toolrun (credentials stay in ~/.kaggle/kaggle.json or KAGGLE_USERNAME/KAGGLE_KEY, never in argv);
output.py brings a version's output home (verified, recorded in the pulls record) and reads how a session ended
from its log. README.md: what each surface reads from Kaggle and from the code dir, and the checks that stop an
attacker (the threat model).

May import controller.launch (the secret-file rule), .results (the pulls record) and onbox's library, and the
agent's own `onbox run` parser (onboxargs.py).
"""
