"""Layout trials and sweeps (layer 8, beside ``inference/``): they launch training runs."""
