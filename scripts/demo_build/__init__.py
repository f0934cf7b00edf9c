"""The demo build's parts, one module per job. ``scripts/build_demo.py`` runs the stages: ``common`` (paths, the
backbone as served, where each reply file lives), ``replies`` (the backbone's questions and topics, distilled
replies), ``heads`` (training, held-out measures and calibration, the draft ranking), ``shipping`` (export and
evaluation). ``scripts/demo_prompts.py`` builds the prompt rounds from ``prompt_sources`` (seed templates, drawn
problems, documentation, the held-out split) and ``topic_rounds`` (rounds 5-6: the backbone's own topics)."""
