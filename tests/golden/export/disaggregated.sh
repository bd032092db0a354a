# Megatron-LM launch flags for the dflop plan [encoder tp1 pp1 dp8 | llm tp4 pp2 dp3 | disaggregated | m=8 ZBH1 zero1]
# (32 GPUs; add the model, data and optimizer flags of your run)
--tensor-model-parallel-size 4 \
--pipeline-model-parallel-size 2 \
--decoder-first-pipeline-num-layers 13 \
--micro-batch-size 10 \
--global-batch-size 240 \
--use-distributed-optimizer \
--grad-reduce-in-bf16
#
# What Megatron-LM cannot express:
#   - per-step balanced bins: Megatron-LM fills every microbatch with the same number of samples
#     in arrival order; dflop's bins (LLM replica x microbatch) differ in size and are balanced on
#     encoder and LLM work by dflop.schedule.sampler.BalancedBatchSampler (see the comment below)
#   - disaggregated placement: the encoder's own 8 GPUs (tp1 pp1 dp8): Megatron-LM core v0.14 and
#     later have no encoder parallelism flags and run the encoder in the first LLM pipeline stage,
#     with llm tp 4 and dp 3 (core v0.13 and earlier took --encoder-tensor-model-parallel-size 1
#     --encoder-pipeline-model-parallel-size 1, the encoder's stages joining every LLM pipeline
#     with the LLM's data parallelism)
#   - pipeline schedule ZBH1: Megatron-LM runs 1F1B (interleaved with virtual stages)
#
# dflop's balanced bins, in this framework's data loader:
#   from dflop.schedule.sampler import BalancedBatchSampler
#   from dflop.workload import DataProfile
#   sampler = BalancedBatchSampler(
#       DataProfile.load('data_profile.json'),  # `dflop profile data --dataset ... --out` of the train set
#       global_batch=240, microbatches=8, solver='lpt', seed=0,
#       dp_size=mpu.get_data_parallel_world_size(), dp_rank=mpu.get_data_parallel_rank())
#   loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, collate_fn=collate)
#   # return it from build_pretraining_data_loader (megatron/training/datasets/data_samplers.py)
# Each iteration yields one microbatch of this rank (a different number of samples each time):
# pack its samples into one sequence (variable-length attention) rather than padding them.
