# Megatron-LM launch flags for the dflop plan [encoder in LLM stage 0 | llm tp2 pp2 dp8 | colocated | m=8 Interleaved1F1B v=2 zero1]
# (32 GPUs; add the model, data and optimizer flags of your run)
--tensor-model-parallel-size 2 \
--pipeline-model-parallel-size 2 \
--num-virtual-stages-per-pipeline-rank 2 \
--micro-batch-size 4 \
--global-batch-size 256 \
--recompute-granularity full \
--recompute-method uniform \
--recompute-num-layers 1 \
--use-distributed-optimizer \
--grad-reduce-in-bf16
#
# What Megatron-LM cannot express:
#   - per-step balanced bins: Megatron-LM fills every microbatch with the same number of samples
#     in arrival order; dflop's bins (LLM replica x microbatch) differ in size and are balanced on
#     encoder and LLM work by dflop.schedule.sampler.BalancedBatchSampler (see the comment below)
#
# dflop's balanced bins, in this framework's data loader:
#   from dflop.schedule.sampler import BalancedBatchSampler
#   from dflop.workload import DataProfile
#   sampler = BalancedBatchSampler(
#       DataProfile.load('data_profile.json'),  # `dflop profile data --dataset ... --out` of the train set
#       global_batch=256, microbatches=8, solver='lpt', seed=0,
#       dp_size=mpu.get_data_parallel_world_size(), dp_rank=mpu.get_data_parallel_rank())
#   loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, collate_fn=collate)
#   # return it from build_pretraining_data_loader (megatron/training/datasets/data_samplers.py)
# Each iteration yields one microbatch of this rank (a different number of samples each time):
# pack its samples into one sequence (variable-length attention) rather than padding them.
