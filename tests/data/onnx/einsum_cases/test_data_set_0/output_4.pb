BimplicitJ@БЈ@nv='bО?WФ
їnv=Џb@Д/А
>K>'bО?Д/АjЭA]Kv?WФ
ї
>K>]Kv?ищ@