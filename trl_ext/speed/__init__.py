"""Exact CPU savings, each off with one log line where it cannot be exact: prompts shared by a group generated once
(``shared_prompts``), a group's log-prob forwards in one sequence (``packing``), oneDNN/MKL-packed linear weights for
inference (``packed_linear``), ``torch.multinomial``'s draws vectorised (``sampling``), and the user's random
generators left as they were (``rng``)."""
