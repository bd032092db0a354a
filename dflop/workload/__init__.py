"""Workloads: samples, dataset readers, synthetic mixes and the data profile."""

from dflop.workload.data_profile import DataProfile, batches, profile_dataset, profile_mix
from dflop.workload.manifest import read_manifest
from dflop.workload.mixes import MixSpec, mix, mix_names, synthesize, with_shares
from dflop.workload.sample import MODALITIES, Modality, Sample, SampleTable

__all__ = [
    "DataProfile", "batches", "profile_dataset", "profile_mix", "read_manifest", "MixSpec", "mix",
    "mix_names", "synthesize", "with_shares", "MODALITIES", "Modality", "Sample", "SampleTable",
]
