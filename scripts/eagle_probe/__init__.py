"""The EAGLE-style drafter probe's parts (``scripts/probe_eagle.py`` trains and measures it): the drafter module
(``drafter``), what its work costs a decoding step in ATen calls (``cost``) and the backbone's served distribution
its drafts are measured and taught against (``served``)."""
