"""The engine-agnostic core: mergeable sketches (statistics, samples) and the metrics that are
pure functions of them. Plain numpy/torch/scikit-learn; imports nothing from Ray or the runs."""
