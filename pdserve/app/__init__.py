"""The application top: the `pdserve` command, `pdserve up`'s launcher and `pdserve health`.
Nothing imports this package; it imports every other."""
