// Stand-in for mach/mach.h on Linux: the types of MTL::Resource::setOwner (a call the fake
// framework does not implement).
#pragma once
typedef int kern_return_t;
typedef unsigned int mach_port_t;
typedef mach_port_t task_id_token_t;
