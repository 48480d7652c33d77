"""Distribution: ranks and collectives (`collectives`), the strategies DDP, FSDP and HSDP (`strategies`),
sharding helpers (`sharding`) and loading a component straight into its shards (`loading`)."""
