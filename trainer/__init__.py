"""The Megatron-core trainer. Importing it keeps megatron's torch.compile fusions off on CPU
(`megatron_cpu.eager_fusions`), before anything imports megatron."""

from trainer import megatron_cpu

megatron_cpu.eager_fusions()
