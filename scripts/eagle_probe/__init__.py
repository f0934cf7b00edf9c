"""The EAGLE-style drafter probe's parts (``scripts/probe_eagle.py`` trains and measures it): the drafter module
(``drafter``) and what its work costs a decoding step in ATen calls (``cost``)."""
