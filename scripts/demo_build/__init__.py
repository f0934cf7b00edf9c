"""The demo build's stages, one module per job (``scripts/build_demo.py`` runs them): ``common`` (paths, the
backbone as served, where each reply file lives), ``replies`` (prompts, topics and distilled replies), ``heads``
(training, held-out measures and calibration, the draft ranking), ``shipping`` (export and evaluation)."""
