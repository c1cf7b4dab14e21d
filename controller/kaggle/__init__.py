"""Kaggle kernels as a target (`onboxctl kaggle push|status|logs|pull`).

folder.py writes the kernel folder (kernel-metadata.json and a script carrying onbox.pyz); kernel_main.py is the
part of that script that runs on Kaggle (standard library only, never imported by onbox); cli.py runs the real
`kaggle` CLI through onbox.toolrun (credentials stay in ~/.kaggle/kaggle.json or KAGGLE_USERNAME/KAGGLE_KEY,
never in argv); output.py brings a version's output home (verified, recorded in the pulls record) and reads how
a session ended from its log.
"""
