"""What only a CPU host needs: the fused decode loop, huge pages for the hot tensors and core
lending between the roles on one host."""
