"""The builtin engine: a PT2 program (torch.export) bound to weights weightlift loads."""
