# Megatron-LM launch flags for the dflop plan [encoder in LLM stage 0 | llm tp1 pp1 dp32 | colocated | m=1 1F1B zero3]
# (32 GPUs; add the model, data and optimizer flags of your run)
--tensor-model-parallel-size 1 \
--pipeline-model-parallel-size 1 \
--micro-batch-size 8 \
--global-batch-size 256 \
--use-distributed-optimizer \
--use-megatron-fsdp \
--data-parallel-sharding-strategy optim_grads_params \
--accumulate-allreduce-grads-in-fp32
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
#       global_batch=256, microbatches=1, solver='lpt', seed=0,
#       dp_size=mpu.get_data_parallel_world_size(), dp_rank=mpu.get_data_parallel_rank())
#   loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, collate_fn=collate)
#   # return it from build_pretraining_data_loader (megatron/training/datasets/data_samplers.py)
# Each iteration yields one microbatch of this rank (a different number of samples each time):
# pack its samples into one sequence (variable-length attention) rather than padding them.
