"""Measuring models: the model profiler (torch) writing to the profile store."""
