"""Runs, start to finish: the analysis pipeline, checkpoint groups and resuming, exact merging of
runs, comparison of runs, and scheduled re-analysis of a watch list."""
