"""The training loops (`finetune`, `masked_lm`) and the pieces they call: the objective and SMART, each task
kind's loss (`losses`), the gradient rule (plain or PCGrad), the weights' moving average, the optimiser,
typed checkpoints, what both loops share (`loop`), and torchrun's processes (`distributed`)."""
