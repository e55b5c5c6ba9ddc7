"""What only a CPU host needs from its memory and cores: huge pages for the hot tensors and
core lending between the roles on one host. Knows no model and no engine."""
