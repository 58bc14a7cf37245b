// placeholder so the library has a source until the model lands
namespace keel { int keel_train_placeholder = 0; }
