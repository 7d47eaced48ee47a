"""`megatron-rlvr compare-replay`: no replay, R2 and R3 (and GRPO vs GSPO, at several off-policy
degrees) run side by side from the same weights, data order and seeds, and a report that says
whether one kept MoE training more stable than the others beyond the spread between seeds. Users
otherwise choose by hand-launching runs and reading dashboards; here the choice comes with its
numbers, or with how many seeds it would take."""
