"""Real trainers of frameworks other than PyTorch, unmodified, saving as their docs show, run under `onbox run` by
tests/integration/test_frameworks_resume.py with the Python of their own venv (build/out/frameworks-venv, `make
frameworks-venv`, from build/frameworks-requirements.txt): never the project's venv, never onbox imported.

  venv.py          where that venv is, and why a test skips (or fails, in CI) without it
  seam.py          the test-only die-at seam the scripts share (a SIGKILL inside the framework's own save)
  json_rename.py   a plain-Python loop saving its state as JSON by a temp name and a rename (the README's journey)
  numpy_savez.py   a numpy loop saving np.savez files in place
  xgb_train.py     XGBoost's xgb.train with callback.TrainingCheckPoint (.ubj models)
  keras_fit.py     Keras 3 (KERAS_BACKEND=jax) fit() with ModelCheckpoint (.keras) or BackupAndRestore (a dir)
  jax_orbax.py     JAX + Flax + Optax with orbax-checkpoint's CheckpointManager (async saves of step dirs)
"""
