"""Figures (``plots``) and the self-contained HTML reports (``html``) of runs and comparisons."""
