"""The training loops and what they use: objective, SMART, PCGrad, optimiser, resume, distributed."""
