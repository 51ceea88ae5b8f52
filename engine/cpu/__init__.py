"""CPU specifics: packed linear layers and the intra-op thread count that follows free cores."""
