namespace keel { int keel_data_placeholder = 0; }
