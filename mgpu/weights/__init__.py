"""What the sharded weights are and what is applied to them: stored formats gathered as stored (fp8), and weight
patches (LoRA) applied to each rank's own rows."""
