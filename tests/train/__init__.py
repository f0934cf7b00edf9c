"""Tests of head training, self-distillation and calibration on tiny models (paper 2.2.1, 2.3.2, 2.3.3), one module per part."""
