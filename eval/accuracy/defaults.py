"""Default methods and keep fractions of ``vtprune bench`` (images), shared by its video and speed modes."""

DEFAULT_METHODS = "none,random,oracle,fastv,fastv+debias,pdrop,transprune,ttv,vflowopt,visionzip,divprune,dart"
DEFAULT_KEEPS = "1,0.5,0.33,0.25,0.11"
